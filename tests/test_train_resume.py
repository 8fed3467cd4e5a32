"""Re-running ``qerl.train.run`` into an existing output_dir (issue 16, items 3 and 6).

A run continues only what it would itself have trained: same recorded settings (run_config.json) or
``--resume force``; a finished run is a no-op; and metrics.jsonl never holds a step twice. Tiny random
dense model with SmolLM2's tokenizer, 2-3 steps of 2 completions of 4 tokens: a few seconds per run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl.cli import run
from qerl.train.run import main
from qerl.train.trainer import CHECKPOINT_MARKER

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))  # only explicit model paths are used here


def _argv(model: Path, out: Path, *extra: str, steps: int = 2, save_steps: int = 1) -> list[str]:
    return [
        "--model-name",
        str(model),
        "--dataset",
        "arithmetic",
        "--num-samples",
        "12",
        "--lora-rank",
        "2",
        "--max-steps",
        str(steps),
        "--save-steps",
        str(save_steps),
        "--per-device-train-batch-size",
        "2",
        "--num-generations",
        "2",
        "--max-completion-length",
        "4",
        "--output-dir",
        str(out),
        "--report-to",
        "none",
        "--disable-tqdm",
        "True",
        "--plot",
        "False",
        "--seed",
        "0",
        "--logging-steps",
        "1",
        *extra,
    ]


def _step_rows(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_finished_run_is_a_no_op(tiny_dense_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = main(_argv(tiny_dense_dir, out))
    assert first["global_step"] == 2
    before = _files(out)
    again = main(_argv(tiny_dense_dir, out))
    assert again == first  # the recorded summary, not one step past max_steps
    assert _files(out) == before and not (out / "checkpoint-3").exists()
    assert _step_rows(out) == [1, 2]


def test_changed_settings_are_refused_in_one_line_unless_forced(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out))
    before = _files(out)
    capsys.readouterr()
    for extra, named in (
        (["--rewards", "last_number"], "rewards"),
        (["--lora-rank", "4"], "lora_rank"),
        (["--num-samples", "10"], "data_sha256, num_samples"),
    ):
        assert run(main, _argv(tiny_dense_dir, out, *extra)) == 2  # (a repeated flag: the later one wins)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()  # progress bars of the data loading, then the error
        assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
        assert lines[-1].startswith(
            f"error: --output_dir {out}: holds a run with different {named}; use --resume force"
        ), err
    assert _files(out) == before  # nothing touched

    # --resume force continues the checkpoint with the new rewards and says so in the summary.
    forced = main(_argv(tiny_dense_dir, out, "--rewards", "last_number", "--resume", "force", steps=3))
    assert forced["global_step"] == 3 and forced["rewards"] == ["last_number"]
    assert forced["resumed_with_changes"] == ["rewards"]
    assert _step_rows(out) == [1, 2, 3]
    assert main(_argv(tiny_dense_dir, out, "--rewards", "last_number", steps=3))["global_step"] == 3  # now recorded


def test_run_without_a_record_is_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "old"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert run(main, _argv(tiny_dense_dir, out)) == 2
    assert "different (unknown: no run_config.json)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "metrics.jsonl"]


def test_metrics_keep_one_row_per_step_across_a_resume(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Killed after step 3 was logged but before its checkpoint was complete (and with a line cut short):
    the resumed run redoes step 3 from checkpoint-2, and metrics.jsonl has it once."""
    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out, steps=3, save_steps=2))
    assert _step_rows(out) == [1, 2, 3]
    (out / "checkpoint-3" / CHECKPOINT_MARKER).unlink()  # the save of step 3 never finished
    (out / "summary.json").unlink()
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    resumed = main(_argv(tiny_dense_dir, out, steps=3, save_steps=2))
    assert resumed["global_step"] == 3
    assert _step_rows(out) == [1, 2, 3]
    assert all(line.endswith("}") for line in (out / "metrics.jsonl").read_text().splitlines())


def test_checkpoint_at_max_steps_is_restored_without_training(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Killed after the last checkpoint but before the summary: the re-run finishes (adapter, summary)
    from checkpoint-2 and trains nothing more."""
    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out))
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    (out / "summary.json").unlink()
    finished = main(_argv(tiny_dense_dir, out))
    assert finished["global_step"] == 2 and not (out / "checkpoint-3").exists()
    assert _step_rows(out) == [1, 2]
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter  # the checkpoint's weights


def test_save_steps_changed_on_resume_takes_effect(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Issue 53, item 7: ``--save-steps`` may change on resume (RESUMABLE_KEYS); transformers restored the
    checkpoint's interval, so the new one was reported and then ignored (only checkpoint-4 was saved)."""
    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out, steps=2, save_steps=2))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    main(_argv(tiny_dense_dir, out, steps=4, save_steps=1))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_adapters_record_their_base(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Issue 53, item 3: the final adapter records the digest of the model it was trained on (checkpoints
    have the run's record beside them), which export and evaluation compare with their --model; a copy of
    the adapter taken out of the run keeps it."""
    import shutil

    from qerl.load.fingerprint import BASE_RECORD, check_adapter_base, model_sha256

    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out, steps=1))
    record = json.loads((out / "adapter" / BASE_RECORD).read_text())
    assert record == {"model": str(tiny_dense_dir), "model_sha256": model_sha256(tiny_dense_dir)}
    shutil.copytree(out / "adapter", tmp_path / "elsewhere")
    for adapter in (out / "adapter", out / "checkpoint-1", tmp_path / "elsewhere"):
        assert check_adapter_base(adapter, str(tiny_dense_dir)) is True


def test_damaged_checkpoint_adapter_is_refused_on_resume(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 53, item 2 on resume: a checkpoint whose adapter holds Inf was restored and trained on (NaN
    losses from then on); the resume now names the checkpoint and the tensor in one line, rc 2."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    main(_argv(tiny_dense_dir, out, steps=2))
    weights = out / "checkpoint-2" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, weights)
    capsys.readouterr()
    assert run(main, _argv(tiny_dense_dir, out, steps=3)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(out / "checkpoint-2") in lines[0] and "1 NaN or Inf values" in lines[0], lines[0]
    assert name.removesuffix(".weight").rsplit(".", 1)[0].split("base_model.model.")[-1] in lines[0], lines[0]
    assert not (out / "checkpoint-3").exists()
