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
from helpers import copy_run, one_error, train_argv

from qerl.cli import run
from qerl.train.run import main
from qerl.train.trainer import CHECKPOINT_MARKER

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def _step_rows(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_finished_run_is_a_no_op(tiny_dense_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = main(train_argv(tiny_dense_dir, out))
    assert first["global_step"] == 2
    before = _files(out)
    again = main(train_argv(tiny_dense_dir, out))
    assert again == first  # the recorded summary, not one step past max_steps
    assert _files(out) == before and not (out / "checkpoint-3").exists()
    assert _step_rows(out) == [1, 2]


def test_changed_settings_are_refused_in_one_line_unless_forced(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    main(train_argv(tiny_dense_dir, out))
    before = _files(out)
    capsys.readouterr()
    for extra, named in (
        (["--rewards", "last_number"], "rewards"),
        (["--lora-rank", "4"], "lora_rank"),
        (["--num-samples", "10"], "data_sha256, num_samples"),
    ):
        assert run(main, train_argv(tiny_dense_dir, out, *extra)) == 2  # (a repeated flag: the later one wins)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()  # progress bars of the data loading, then the error
        assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
        assert lines[-1].startswith(
            f"error: --output_dir {out}: holds a run with different {named}; use --resume force"
        ), err
    assert _files(out) == before  # nothing touched

    # --resume force continues the checkpoint with the new rewards and says so in the summary.
    forced = main(train_argv(tiny_dense_dir, out, "--rewards", "last_number", "--resume", "force", steps=3))
    assert forced["global_step"] == 3 and forced["rewards"] == ["last_number"]
    assert forced["resumed_with_changes"] == ["rewards"]
    assert _step_rows(out) == [1, 2, 3]
    assert (
        main(train_argv(tiny_dense_dir, out, "--rewards", "last_number", steps=3))["global_step"] == 3
    )  # now recorded


def test_run_without_a_record_is_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "old"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert run(main, train_argv(tiny_dense_dir, out)) == 2
    assert "different (unknown: no run_config.json)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "metrics.jsonl"]


def test_metrics_keep_one_row_per_step_across_a_resume(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Killed after step 3 was logged but before its checkpoint was complete (and with a line cut short):
    the resumed run redoes step 3 from checkpoint-2, and metrics.jsonl has it once."""
    out = tmp_path / "run"
    main(train_argv(tiny_dense_dir, out, steps=3, save_steps=2))
    assert _step_rows(out) == [1, 2, 3]
    (out / "checkpoint-3" / CHECKPOINT_MARKER).unlink()  # the save of step 3 never finished
    (out / "summary.json").unlink()
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    resumed = main(train_argv(tiny_dense_dir, out, steps=3, save_steps=2))
    assert resumed["global_step"] == 3
    assert _step_rows(out) == [1, 2, 3]
    assert all(line.endswith("}") for line in (out / "metrics.jsonl").read_text().splitlines())


def test_checkpoint_at_max_steps_is_restored_without_training(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Killed after the last checkpoint but before the summary: the re-run finishes (adapter, summary)
    from checkpoint-2 and trains nothing more."""
    out = tmp_path / "run"
    main(train_argv(tiny_dense_dir, out))
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    (out / "summary.json").unlink()
    finished = main(train_argv(tiny_dense_dir, out))
    assert finished["global_step"] == 2 and not (out / "checkpoint-3").exists()
    assert _step_rows(out) == [1, 2]
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter  # the checkpoint's weights


def test_save_steps_changed_on_resume_takes_effect(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Issue 53, item 7: ``--save-steps`` may change on resume (RESUMABLE_KEYS); transformers restored the
    checkpoint's interval, so the new one was reported and then ignored (only checkpoint-4 was saved)."""
    out = tmp_path / "run"
    main(train_argv(tiny_dense_dir, out, steps=2, save_steps=2))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    main(train_argv(tiny_dense_dir, out, steps=4, save_steps=1))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_adapters_record_their_base(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Issue 53, item 3: the final adapter records the digest of the model it was trained on (checkpoints
    have the run's record beside them), which export and evaluation compare with their --model; a copy of
    the adapter taken out of the run keeps it."""
    import shutil

    from qerl.fingerprint import BASE_RECORD, check_adapter_base, model_sha256

    out = tmp_path / "run"
    main(train_argv(tiny_dense_dir, out, steps=1))
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
    main(train_argv(tiny_dense_dir, out, steps=2))
    weights = out / "checkpoint-2" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, weights)
    capsys.readouterr()
    assert run(main, train_argv(tiny_dense_dir, out, steps=3)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(out / "checkpoint-2") in lines[0] and "1 NaN or Inf values" in lines[0], lines[0]
    assert name.removesuffix(".weight").rsplit(".", 1)[0].split("base_model.model.")[-1] in lines[0], lines[0]
    assert not (out / "checkpoint-3").exists()


# --- resuming a changed, damaged or extended run ----------------------------------------------------------------------


def test_run_that_saved_nothing_does_not_block_the_corrected_rerun(tmp_path: Path) -> None:
    """A run that crashed in step 1 refused the corrected rerun into its directory ('different settings')."""
    from qerl.cli import UsageError
    from qerl.train import resume

    out = tmp_path / "run"
    out.mkdir()
    resume.save(out, {"learning_rate": 1.0})
    (out / resume.METRICS_FILE).write_text('{"step": 1, "loss": 0.5}\n')
    assert resume.continuation(out, {"learning_rate": 1e-5}, "auto", 10) == resume.Continuation(
        changed=[], finished=None
    )
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / resume.CHECKPOINT_MARKER).write_text("{}")
    with pytest.raises(UsageError, match="different learning_rate"):
        resume.continuation(out, {"learning_rate": 1e-5}, "auto", 10)


@pytest.fixture(scope="module")
def narrow_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny chat Llama of another width than ``tiny_dense_dir``'s: its adapters do not fit that model."""
    from tiny_models import copy_tokenizer, make_tiny_llama

    out = tmp_path_factory.mktemp("narrow") / "narrow"
    return copy_tokenizer(smollm2_dir, make_tiny_llama(out, hidden=32, vocab=49152, bos_token_id=1, eos_token_id=2))


def test_forced_resume_with_another_model_leaves_the_record_alone(
    trained: Path, narrow_dir: Path, tmp_path: Path, capsys
) -> None:
    """--resume force with a model the checkpoint does not fit rewrote run_config.json, then failed (a traceback):
    the original run then refused to resume. Now: one line, and the record is the original run's."""
    out = copy_run(trained, tmp_path)
    record = (out / "run_config.json").read_bytes()
    capsys.readouterr()
    line = one_error(run(main, train_argv(narrow_dir, out, "--resume", "force", steps=3)), capsys.readouterr().err)
    assert str(out / "checkpoint-2") in line and "shape" in line, line
    assert (out / "run_config.json").read_bytes() == record
    assert not (out / "checkpoint-3").exists()


def _nan_in_optimizer(ckpt: Path) -> None:
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    next(iter(state["state"].values()))["exp_avg_sq"].view(-1)[0] = float("nan")
    torch.save(state, ckpt / "optimizer.pt")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, file",
    [
        (_nan_in_optimizer, "optimizer.pt"),
        (lambda ckpt: _truncate(ckpt / "optimizer.pt"), "optimizer.pt"),
        (lambda ckpt: _truncate(ckpt / "trainer_state.json"), "trainer_state.json"),
        (lambda ckpt: _truncate(ckpt / "adapter_model.safetensors"), "adapter_model.safetensors"),
        (lambda ckpt: _truncate(ckpt / "scheduler.pt"), "scheduler.pt"),
    ],
)
def test_damaged_checkpoint_is_refused_and_the_previous_one_offered(
    trained: Path, tiny_dense_dir: Path, tmp_path: Path, capsys, damage, file: str
) -> None:
    """One NaN in the optimizer state gave rc 0 and an all-NaN adapter; a truncated file gave a traceback. Now the
    whole checkpoint is checked: one line naming the file and the previous checkpoint, nothing changed; with
    --damaged_checkpoint previous the damaged one is moved aside and the run resumes from the one before."""
    out = copy_run(trained, tmp_path)
    damage(out / "checkpoint-2")
    record = (out / "run_config.json").read_bytes()
    capsys.readouterr()
    line = one_error(run(main, train_argv(tiny_dense_dir, out, steps=3)), capsys.readouterr().err)
    assert str(out / "checkpoint-2" / file) in line and "--damaged_checkpoint previous" in line, line
    assert "checkpoint-1" in line, line
    assert (out / "run_config.json").read_bytes() == record and not (out / "checkpoint-3").exists()

    summary = main(train_argv(tiny_dense_dir, out, "--damaged_checkpoint", "previous", steps=3))
    assert summary["global_step"] == 3 and list(out.glob(".damaged-checkpoint-2-*"))
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_extending_max_steps_replans_the_learning_rate(
    trained: Path, tiny_dense_dir: Path, tmp_path: Path, caplog
) -> None:
    """A 2-step run's linear schedule ends at learning rate 0, and the optimizer file keeps that rate: extended to 4
    steps, its first new step ran at 0. The schedule is re-planned to the new end (one log line): steps 3 and 4 run
    at the rates of a 4-step plan at those steps (the dense model's default rate x 2/4, x 1/4)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from qerl.train.config import LR_BF16

    out = copy_run(trained, tmp_path)
    rates: list[float] = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: rates.append(optimizer.param_groups[0]["lr"])
    )
    try:
        main(train_argv(tiny_dense_dir, out, steps=4))
    finally:
        hook.remove()
    assert rates == pytest.approx([LR_BF16 * 2 / 4, LR_BF16 * 1 / 4])
    assert "re-planned to end at step 4" in caplog.text


def test_memory_knobs_may_change_on_resume(tmp_path: Path) -> None:
    """Freeing the rollout engine's memory for the pass changes no number: a run may resume with it set otherwise
    (e.g. after an out-of-memory error), while a setting that changes what is computed is still named."""
    from qerl.cli import UsageError
    from qerl.train.resume import RUN_CONFIG_FILE, continuation

    (tmp_path / RUN_CONFIG_FILE).write_text(json.dumps({"lora_rank": 16, "release_rollout_memory": None}))
    (tmp_path / "adapter").mkdir()  # work a changed run could spoil
    assert continuation(tmp_path, {"lora_rank": 16, "release_rollout_memory": True}, "auto", 0).changed == []
    with pytest.raises(UsageError, match="holds a run with different lora_rank"):
        continuation(tmp_path, {"lora_rank": 8, "release_rollout_memory": None}, "auto", 0)
