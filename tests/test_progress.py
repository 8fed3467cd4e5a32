"""What a training run prints (issue 78; ``qerl.train.progress``): one compact line per step instead of a dict of ~40
metrics (all of them still in metrics.jsonl), a report of the finished run (steps, reward, held-out accuracy before
-> after, step time, peak memory), settings logged as written (``'cosine'``, not ``<SchedulerType.COSINE: 'cosine'>``)
and a model card that names its local base model (trl wrote "a fine-tuned version of [None]")."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DefaultFlowCallback, PrinterCallback, ProgressCallback
from transformers.trainer_callback import CallbackHandler

from qerl.cli import run
from qerl.train import progress
from qerl.train.run import main

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "benchmarks" / "results" / "quickstart_cpu"


def test_step_line_holds_the_numbers_a_user_watches() -> None:
    first = json.loads((QUICKSTART / "metrics.jsonl").read_text().splitlines()[0])
    line = progress.step_line(1, 8, first)
    assert line == (
        "step 1/8 | reward 0.358 ± 0.273 | last_number_accuracy 0.000 | last_number_closeness 0.358 | length 64 | "
        "sigma 0 | loss 0.0494 | 33.8 s (rollout 10.5 s)"
    )
    assert progress.step_line(8, 8, {"train_runtime": 221.0, "train_loss": 0.1}).startswith("trained 8 steps in 221 s")
    none = {"reward": 1.0, "reward_std": None, "rewards/none_reward/mean": None}  # a reward function's None
    assert progress.step_line(2, 8, none) == "step 2/8 | reward 1.000 ± n/a | none_reward n/a"


def test_report_of_a_finished_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(QUICKSTART, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "peak_rss_gib": 5.27}))
    assert progress.report(run_dir).splitlines() == [
        "trained 8 steps of GRPO on qmodel/smollm2-135m-NVFP4A16 (arithmetic)",
        "reward: 0.358 at step 1 -> 0.316 at step 8 (mean 0.352)",
        "held-out accuracy (greedy, 8 questions): 0/8 -> 0/8",
        "step time: 27.5 s a step, rollout 10.0 s of it; whole run 3 min 41 s of training",
        "peak memory: 5.27 GiB resident (the training process)",
    ]


def test_report_of_no_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(progress.main, [str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: no summary.json (not a finished qerl.train run)"


@pytest.mark.parametrize(
    ("theirs", "ours"), [(ProgressCallback, progress.StepLineProgress), (PrinterCallback, progress.StepLinePrinter)]
)
def test_the_console_callback_is_swapped(theirs: type, ours: type) -> None:
    class Trainer:
        handler = CallbackHandler([DefaultFlowCallback, theirs], None, None, None, None)
        pop_callback, add_callback = handler.pop_callback, handler.add_callback

    progress.use_step_lines(Trainer)
    assert [type(c) for c in Trainer.handler.callbacks] == [DefaultFlowCallback, ours]


def test_a_run_prints_step_lines_and_names_its_base(
    tiny_dense_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    flags = {
        "--model-name": tiny_dense_dir,
        "--dataset": "arithmetic",
        "--num-samples": 12,
        "--heldout": 2,
        "--heldout-max-tokens": 4,
        "--lora-rank": 2,
        "--max-steps": 2,
        "--save-steps": 1,
        "--per-device-train-batch-size": 2,
        "--num-generations": 2,
        "--max-completion-length": 4,
        "--lr-scheduler-type": "cosine",
        "--output-dir": out,
        "--report-to": "none",
        "--disable-tqdm": True,
        "--plot": False,
        "--seed": 0,
        "--logging-steps": 1,
    }
    with caplog.at_level(logging.INFO):
        summary = main([str(x) for flag, value in flags.items() for x in (flag, value)])
    printed = capsys.readouterr().out
    assert [line.split(" | ")[0] for line in printed.splitlines() if line.startswith("step ")] == [
        "step 1/2",
        "step 2/2",
    ]
    assert "{'loss'" not in printed and "'reward'" not in printed  # no dict of every metric
    assert len(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])) > 20  # they are all here
    assert "lr_scheduler_type='cosine' (trl: 'linear')" in caplog.text and "SchedulerType" not in caplog.text
    card = (out / "README.md").read_text()
    assert "[None]" not in card and f"fine-tuned version of `{tiny_dense_dir}` (a local model directory" in card
    assert 0 < summary["peak_rss_gib"] < 64
    assert "held-out accuracy (greedy, 2 questions)" in progress.report(out)
