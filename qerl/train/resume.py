"""Whether a training run may write its ``output_dir`` (:func:`check_output_dir`: no link, not the model's, empty or
a run's own) and continue what it already holds.

Every run records its settings in ``output_dir/run_config.json`` (written atomically before training
starts): the model/data/adapter choices, every trainer setting, and digests of the training rows and
of the model weights. A later run into the same directory compares its own settings with that record:

* the same settings: continue from the newest complete checkpoint, or, when ``summary.json`` says the
  run already reached ``max_steps``, do nothing and report that summary (``--resume auto``);
* different settings: refuse with one line naming the keys that differ, because continuing would
  train an adapter on a mixture and label it with the new settings; ``--resume force`` continues
  anyway and the summary lists the keys that changed (``resumed_with_changes``); a run that saved
  nothing yet (no complete checkpoint, adapter or summary: it crashed early) is simply started afresh;
* a directory holding run files but no record (an older qerl): refused likewise, its settings unknown.

Some settings may change between the runs (``RESUMABLE_KEYS``): where results go, how often they are
logged or saved, memory/speed knobs, and ``max_steps``, which extends (or ends) a run; the LR and AQN
schedules then stretch over the new length (the trainer warns).

The run files themselves: checkpoints count once their completion marker is written
(:func:`last_complete_checkpoint`) and are resumed only when every file reads back whole and finite and the
adapter fits the model (``qerl.train.checkpoint_check``), and ``metrics.jsonl`` (:class:`MetricsFile`) keeps one row per
step across interruptions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from qerl.cli import UsageError, usage_errors
from qerl.fsutil import append_whole, atomic_write_text, is_within, real_output

logger = logging.getLogger(__name__)

#: Written last into every checkpoint; a checkpoint without it is incomplete.
CHECKPOINT_MARKER = "qerl_checkpoint.json"
#: Metrics appended one JSON line per log step (read by ``qerl.train.plot``; survives crashes).
METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"
SUMMARY_FILE = "summary.json"
RESUME_MODES = ("auto", "force")
#: Files whose presence means that ``output_dir`` holds (part of) a run.
RUN_FILES = ("metrics.jsonl", SUMMARY_FILE, "adapter")
#: Settings that may differ between a run and its continuation (see the module docstring).
RESUMABLE_KEYS = frozenset(
    {
        # where things go and what is reported
        "output_dir",
        "run_name",
        "project",
        "report_to",
        "disable_tqdm",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "logging_steps",
        "logging_strategy",
        "logging_first_step",
        "log_completions",
        "log_completions_hub_repo",
        "log_multimodal",
        "log_unique_prompts",
        "num_completions_to_print",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "save_on_each_node",
        "save_only_model",
        "push_to_hub",
        "hub_model_id",
        "hub_strategy",
        "hub_token",
        "hub_private_repo",
        "hub_always_push",
        "hub_revision",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "resume_from_checkpoint",
        "resume",
        "plot",
        "heldout_max_tokens",
        "skip_memory_metrics",
        # memory and speed, not what is computed
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "release_rollout_memory",
        "torch_empty_cache_steps",
        "vllm_gpu_memory_utilization",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "local_rank",
        "is_ratio_from_loss_pass",
        # what to do about a damaged checkpoint (the one resumed from is checked either way)
        "damaged_checkpoint",
        # the run's length (schedules stretch; the trainer warns)
        "max_steps",
    }
)


def rows_sha256(*datasets: Iterable[dict[str, Any]]) -> str:
    """Digest of the rows a run trains and is measured on, whatever their source (file, hub, generator)."""
    h = hashlib.sha256()
    for i, rows in enumerate(datasets):
        h.update(f"\0part {i}\n".encode())
        for row in rows:
            h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def run_config(*settings: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One flat, JSON-normalised record of settings (script arguments, trainer config) plus ``extra``
    values (digests, resolved defaults), as it reads back from JSON (tuples become lists)."""
    flat: dict[str, Any] = {}
    for part in (*settings, extra):
        flat.update(part)
    return json.loads(json.dumps(flat, sort_keys=True, default=str))


@dataclass(frozen=True)
class Continuation:
    """How a run into ``output_dir`` continues the run recorded there: ``finished`` (that run's summary, to report:
    nothing to train) or train on; ``changed`` lists settings that differ from the recorded ones (only with
    ``force``)."""

    changed: list[str]
    finished: dict[str, Any] | None


def continuation(out: Path, wanted: dict[str, Any], mode: str, max_steps: int) -> Continuation:
    """Compare ``wanted`` with the run recorded in ``out``; raise UsageError when it may not continue."""
    if mode not in RESUME_MODES:
        raise UsageError(f"--resume: expected one of {', '.join(RESUME_MODES)}, got {mode!r}")
    record = out / RUN_CONFIG_FILE
    force = "use --resume force to continue it anyway, or a new --output_dir"
    if record.exists():
        try:
            saved = json.loads(record.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            saved = None
        if not isinstance(saved, dict):
            raise UsageError(f"--output_dir {out}: {record.name} is not a settings record; {force}")
        changed = sorted(
            k for k in saved.keys() | wanted.keys() if k not in RESUMABLE_KEYS and saved.get(k) != wanted.get(k)
        )
    else:
        changed = ["(unknown: no run_config.json)"] if holds_run(out) else []
    if changed and mode != "force" and record.exists() and not _holds_work(out):  # no record: an older qerl's run
        logger.info(
            "%s: its run (different %s) saved no checkpoint, adapter or summary; starting afresh with these settings",
            out,
            ", ".join(changed),
        )
        changed = []
    if changed and mode != "force":
        raise UsageError(f"--output_dir {out}: holds a run with different {', '.join(changed)}; {force}")
    summary = _read_summary(out / SUMMARY_FILE)
    done = summary is not None and (max_steps <= 0 or int(summary.get("global_step") or 0) >= max_steps)
    return Continuation(changed=changed, finished=summary if done and not changed else None)


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds (part of) a training run: its settings record, metrics, summary, adapter or a
    checkpoint. A directory holding anything else is not a run's to write into (``qerl.train.run``)."""
    return (
        (out / RUN_CONFIG_FILE).exists()
        or any((out / name).exists() for name in RUN_FILES)
        or any(out.glob(f"{PREFIX_CHECKPOINT_DIR}-*"))
    )


def check_output_dir(out: Path, model: str, resolved: Path | str) -> None:
    """Refuse an ``--output_dir`` that a run may not write: a symbolic link (``qerl.fsutil.real_output``), the
    model's directory or one inside it (the run's checkpoints, metrics and adapter would be mixed into the model's
    files), or a directory holding files but no run (``--output_dir .`` replaced a checkout's README: a run
    resumes into a run directory of its own only, as eval, export and quantize refuse a non-empty target).
    ``model`` is ``--model_name`` as given, ``resolved`` what ``qerl.hub.resolve_model`` made of it."""
    with usage_errors(ValueError):
        resolved_out = real_output(out, "--output_dir")
    _not_the_model(out, model, resolved)
    if resolved_out.exists() and not resolved_out.is_dir():
        raise UsageError(f"--output_dir {out}: is not a directory")
    if resolved_out.is_dir() and any(resolved_out.iterdir()) and not holds_run(resolved_out):
        raise UsageError(
            f"--output_dir {out}: is not empty and holds no qerl run (no {RUN_CONFIG_FILE}, metrics or "
            "checkpoint); name a new or empty directory"
        )


def _not_the_model(out: Path, model: str, resolved: Path | str) -> None:
    """Refuse an output that is a local model's directory or lies inside it (quantize and export refuse the same)."""
    if isinstance(resolved, str):  # a hub id: its download is no directory of the user's
        return
    if is_within(out, Path(resolved)):
        same = out.expanduser().resolve() == Path(resolved).resolve()
        raise UsageError(
            f"--output_dir {out}: is {'the' if same else 'inside the'} model directory "
            f"({model}); choose a directory outside it"
        )


def _holds_work(out: Path) -> bool:
    """Whether ``out`` holds anything a run with other settings could spoil: a complete checkpoint, the final
    adapter or the summary. A run that crashed before its first save (a wrong flag found in step 1) holds
    nothing worth protecting, so the corrected rerun into the same directory is not refused."""
    return (
        (out / SUMMARY_FILE).exists()
        or (out / "adapter").exists()
        or any(out.glob(f"{PREFIX_CHECKPOINT_DIR}-*/{CHECKPOINT_MARKER}"))
    )


def _read_summary(path: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return summary if isinstance(summary, dict) else None


def save(out: Path, wanted: dict[str, Any]) -> None:
    """Record the settings of the run about to train into ``out`` (atomically)."""
    atomic_write_text(out / RUN_CONFIG_FILE, json.dumps(wanted, indent=1, sort_keys=True) + "\n")


class MetricsFile(TrainerCallback):
    """Appends every log record (with its step) to ``output_dir/metrics.jsonl``, whole lines pushed to disk
    one by one (``qerl.fsutil.append_whole``: a full disk leaves no part of a line).

    At the start of training (state restored by then) rows of later steps than the one training starts
    from are dropped: they were logged by an interrupted attempt whose checkpoint did not survive, and
    the steps are about to run again. A line a crash cut short goes too.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        path = Path(args.output_dir) / METRICS_FILE
        if not state.is_world_process_zero or not path.exists():
            return
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) is not None and _logged_step(line) <= state.global_step]
        if len(kept) != len(lines):
            logger.info(
                "%s: dropping %d rows logged after step %d (that work is redone now)",
                path,
                len(lines) - len(kept),
                state.global_step,
            )
            atomic_write_text(path, "".join(kept))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {
            "step": state.global_step,
            **{k: v for k, v in logs.items() if isinstance(v, (int, float, str)) or v is None},
        }
        append_whole(Path(args.output_dir) / METRICS_FILE, json.dumps(record) + "\n")


def _logged_step(line: str) -> int | None:
    """The step of a whole metrics line; None for a line cut short or not ours."""
    if not line.endswith("\n"):
        return None
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) else None


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """Newest ``checkpoint-N`` holding the completion marker; incomplete ones are renamed aside
    (``.incomplete-checkpoint-N``) so that neither resume nor rotation ever picks them up."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = d.name[len(PREFIX_CHECKPOINT_DIR) + 1 :]
        if not d.is_dir() or not suffix.isdigit():
            continue
        if not (d / CHECKPOINT_MARKER).exists():
            logger.warning(
                "checkpoint %s is incomplete (interrupted save); moved to %s", d, move_aside(d, "incomplete")
            )
            continue
        if best is None or int(suffix) > best[0]:
            best = (int(suffix), d)
    return None if best is None else str(best[1])


def move_aside(checkpoint: Path, why: str) -> Path:
    """Rename ``checkpoint`` to ``.WHY-checkpoint-N-TIME`` beside it: out of reach of resume and rotation, kept
    for a look."""
    aside = checkpoint.parent / f".{why}-{checkpoint.name}-{int(time.time())}"
    shutil.move(str(checkpoint), str(aside))
    return aside


__all__ = [
    "CHECKPOINT_MARKER",
    "check_output_dir",
    "METRICS_FILE",
    "MetricsFile",
    "last_complete_checkpoint",
    "move_aside",
    "RUN_CONFIG_FILE",
    "RESUMABLE_KEYS",
    "RESUME_MODES",
    "Continuation",
    "continuation",
    "holds_run",
    "rows_sha256",
    "run_config",
    "save",
]
