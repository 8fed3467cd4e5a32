"""What a training run prints: one compact line per logged step, and the run's report at the end.

transformers prints each log record as a dict of every metric (about 40 for a GRPO step): the few numbers a user
watches (reward, accuracy, KL, completion length, step time) drown in it. Here the console gets one line per step;
every metric still goes to ``metrics.jsonl`` (``qerl.train.resume.MetricsFile``) and to the ``report_to`` loggers.
At the end, :func:`report` reads a finished run's ``summary.json`` and ``metrics.jsonl`` back and says what happened:
steps, reward, held-out accuracy before -> after, step time, peak memory (``python -m qerl.train.progress RUN``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from qerl.cli import ArgumentParser, UsageError, run

#: (log key, label, format) of the step line after the reward and each reward function's mean.
STEP_FIELDS = (
    ("kl", "kl", "{:.4f}"),
    ("completions/mean_length", "length", "{:.0f}"),
    ("aqn/sigma", "sigma", "{:.3g}"),
    ("loss", "loss", "{:.4f}"),
)


def step_line(step: int, max_steps: int, logs: dict[str, Any]) -> str:
    """``step 3/8 | reward 0.401 ± 0.330 | last_number_accuracy 0.000 | ... | 33.8 s (rollout 10.5 s)`` for a
    training step's log record; the end-of-training record reads ``trained N steps in T s``. A value that is no number
    (a reward function that returned None for every completion) reads ``n/a``."""
    if "train_runtime" in logs:
        return f"trained {step} steps in {_number(logs['train_runtime'], '{:.0f}')} s; every metric: metrics.jsonl"
    parts = [f"step {step}/{max_steps}"]
    if "reward" in logs:
        parts.append(f"reward {_number(logs['reward'], '{:.3f}')} ± {_number(logs.get('reward_std'), '{:.3f}')}")
    parts += [f"{m[1]} {_number(v, '{:.3f}')}" for k, v in logs.items() if (m := re.fullmatch(r"rewards/(.+)/mean", k))]
    parts += [f"{label} {_number(logs[key], fmt)}" for key, label, fmt in STEP_FIELDS if key in logs]
    if "step_time" in logs:
        rollout = f" (rollout {_number(logs['rollout/seconds'], '{:.1f}')} s)" if "rollout/seconds" in logs else ""
        parts.append(f"{_number(logs['step_time'], '{:.1f}')} s{rollout}")
    return " | ".join(parts)


def _number(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, int | float) and not isinstance(value, bool) else "n/a"


class _StepLines:
    """``on_log`` of both console callbacks: the compact line instead of the dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            tqdm.write(step_line(state.global_step, state.max_steps, logs))


class StepLineProgress(_StepLines, ProgressCallback):
    """transformers' progress bar, with a compact line per logged step."""


class StepLinePrinter(_StepLines, TrainerCallback):
    """The compact line per logged step, without a progress bar (``--disable_tqdm True``)."""


def use_step_lines(trainer: Any) -> None:
    """Swap the trainer's console callback (the bar, or the printer under ``--disable_tqdm``) for its compact twin."""
    for theirs, ours in ((ProgressCallback, StepLineProgress), (PrinterCallback, StepLinePrinter)):
        if trainer.pop_callback(theirs) is not None:
            trainer.add_callback(ours)


def report(run_dir: Path) -> str:
    """What a finished run did, from its ``summary.json`` and ``metrics.jsonl``, in a few lines."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward" in r]
    lines = [f"trained {summary.get('global_step')} steps of GRPO on {summary.get('model')} ({summary.get('dataset')})"]
    if steps:
        lines.append(
            f"reward: {steps[0]['reward']:.3f} at step {steps[0]['step']} -> {steps[-1]['reward']:.3f} at step "
            f"{steps[-1]['step']} (mean {statistics.mean(r['reward'] for r in steps):.3f})"
        )
    held = summary.get("heldout_rows") or 0
    if "heldout_accuracy_before" in summary and held:
        before, after = (summary.get(f"heldout_accuracy_{w}") for w in ("before", "after"))
        lines.append(f"held-out accuracy (greedy, {held} questions): {_count(before, held)} -> {_count(after, held)}")
    times = [r["step_time"] for r in steps if "step_time" in r]
    if times:
        rollout = [r["rollout/seconds"] for r in steps if "rollout/seconds" in r]
        of_it = f", rollout {statistics.mean(rollout):.1f} s of it" if rollout else ""
        lines.append(f"step time: {statistics.mean(times):.1f} s a step{of_it}; whole run {_minutes(summary)}")
    if summary.get("peak_rss_gib") is not None:
        lines.append(f"peak memory: {summary['peak_rss_gib']:.2f} GiB resident (the training process)")
    return "\n".join(lines)


def _count(accuracy: float | None, rows: int) -> str:
    return "n/a" if accuracy is None or math.isnan(accuracy) else f"{round(accuracy * rows)}/{rows}"


def _minutes(summary: dict[str, Any]) -> str:
    seconds = summary.get("train_runtime_s")
    return "n/a" if seconds is None else f"{int(seconds // 60)} min {int(seconds % 60)} s of training"


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m qerl.train.progress", description="What a finished training run did.")
    parser.add_argument("run_dir", type=Path, help="the run's --output_dir (it holds summary.json once finished)")
    run_dir = parser.parse_args(argv).run_dir
    if not (run_dir / "summary.json").is_file():
        raise UsageError(f"{run_dir}: no summary.json (not a finished qerl.train run)")
    print(report(run_dir))


if __name__ == "__main__":
    sys.exit(run(main))
