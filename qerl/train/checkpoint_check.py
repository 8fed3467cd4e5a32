"""Whether a training checkpoint can be resumed: every file read back whole and finite, its adapter the model's, its
recorded state of the types and steps transformers acts on.

transformers restores a checkpoint's files one by one where it meets them: a truncated ``trainer_state.json``,
``optimizer.pt`` or adapter was a traceback mid-restore, and one NaN in the optimizer's moments turned every
trained weight NaN with exit status 0. :func:`sound_checkpoint` checks all of it before anything is restored, so a
refused resume changes nothing in the run's directory (``qerl.train.run`` records the run's settings only after it).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from qerl.cli import UsageError, one_line
from qerl.fsutil import is_within
from qerl.train.resume import CHECKPOINT_MARKER, last_complete_checkpoint, move_aside

logger = logging.getLogger(__name__)


def sound_checkpoint(out: Path, adapter_shapes: dict[str, tuple[int, ...]], take_previous: bool) -> str | None:
    """The newest complete checkpoint of ``out`` that :func:`check_checkpoint` passes, None for none.

    A damaged one is refused in one line that names the file and the checkpoint to fall back on; with
    ``take_previous`` (``--damaged_checkpoint previous``) it is moved aside (``.damaged-checkpoint-N-TIME``) and
    the one before it is tried. A checkpoint of another model is refused either way: every earlier one is too."""
    while (newest := last_complete_checkpoint(out)) is not None:
        try:
            check_checkpoint(Path(newest), adapter_shapes)
            return newest
        except IncompatibleCheckpoint as e:
            raise UsageError(
                f"{e}; resume with the model and --lora_* settings it was trained with, or use a new --output_dir"
            ) from None
        except DamagedCheckpoint as e:
            if not take_previous:
                raise UsageError(f"{e}; {_fallback(Path(newest))}") from None
            logger.warning("%s; moved to %s, trying the checkpoint before it", e, move_aside(Path(newest), "damaged"))
    return None


def _fallback(damaged: Path) -> str:
    """What ``--damaged_checkpoint previous`` would do instead of resuming from ``damaged``."""
    earlier = sorted(
        (int(d.name.rpartition("-")[2]), d.name)
        for d in damaged.parent.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        if d != damaged and d.name.rpartition("-")[2].isdigit() and (d / CHECKPOINT_MARKER).exists()
    )
    then = f"resumes from {earlier[-1][1]}" if earlier else "starts the run afresh (no earlier checkpoint)"
    return f"--damaged_checkpoint previous moves it aside and {then}"


class DamagedCheckpoint(ValueError):
    """A complete-looking checkpoint (marker written) whose files cannot be resumed from."""


class IncompatibleCheckpoint(ValueError):
    """A sound checkpoint of another model (or other LoRA settings): its adapter does not fit this one."""


#: What a checkpoint must hold to be resumed (optimizer, scheduler and RNG files are checked when present:
#: ``--save_only_model`` leaves them out, and transformers then starts a fresh optimizer by design).
REQUIRED_FILES = ("trainer_state.json", "adapter_model.safetensors", CHECKPOINT_MARKER)


def check_checkpoint(path: Path, adapter_shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`DamagedCheckpoint` (one line naming the file) unless every file of checkpoint ``path``
    reads back whole and finite, its adapter has the tensors and shapes ``adapter_shapes`` (the model's), and its
    ``trainer_state.json`` holds what transformers would act on safely (:data:`STATE_FIELDS`, the step the
    checkpoint is named after, a ``best_model_checkpoint`` inside the run or none).

    Why all of it: transformers restores each file where it meets it, so a truncated one was a traceback
    mid-restore, and one NaN in the optimizer's moments turned every trained weight NaN with exit status 0.
    Checking before anything is restored also keeps a refused resume from changing the run's files."""
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise DamagedCheckpoint(f"{path / name}: missing")
    marker, state = (_read_json(path / name) for name in (CHECKPOINT_MARKER, "trainer_state.json"))
    _check_state(path / "trainer_state.json", state)
    for file, record in ((path / CHECKPOINT_MARKER, marker), (path / "trainer_state.json", state)):
        if record.get("global_step") != int(path.name.rpartition("-")[2]):
            raise DamagedCheckpoint(
                f"{file}: global_step is {record.get('global_step')!r}, expected {path.name.rpartition('-')[2]} "
                "(the checkpoint's number)"
            )
    best = state.get("best_model_checkpoint")
    if best is not None and not is_within(Path(best), path.parent):
        raise DamagedCheckpoint(
            f"{path / 'trainer_state.json'}: best_model_checkpoint {best!r} is outside the run {path.parent}"
        )
    _check_adapter(path / "adapter_model.safetensors", adapter_shapes)
    for file in sorted(path.glob("*.pt")) + sorted(path.glob("rng_state*.pth")):
        _check_finite(file, _torch_load(file))


def _read_json(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON object, or DamagedCheckpoint (a 100,000-deep nesting too: RecursionError)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise DamagedCheckpoint(f"{file}: not readable JSON ({one_line(e)})") from None
    if not isinstance(value, dict):
        raise DamagedCheckpoint(f"{file}: not readable JSON (not a JSON object)")
    return value


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _instance(*types: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types)


_COUNT, _NUMBER = (_count, "an integer >= 0"), (_number, "a number >= 0")
#: What each field of ``trainer_state.json`` must hold. transformers restores the file as found: global_step -5 ran
#: steps -4, -3, ... (saving checkpoint--2, dropping the metrics of the steps after -5), a best_model_checkpoint
#: outside the run made checkpoint rotation delete the run's own checkpoints, a string step was a traceback.
STATE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(("global_step", "max_steps", "num_input_tokens_seen"), _COUNT),
    **dict.fromkeys(("epoch", "num_train_epochs", "total_flos", "logging_steps", "eval_steps", "save_steps"), _NUMBER),
    **dict.fromkeys(("train_batch_size", "best_global_step"), (_optional(_count), "an integer >= 0 or null")),
    "best_metric": (_optional(lambda v: type(v) in (int, float) and math.isfinite(v)), "a finite number or null"),
    "log_history": (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v), "a list of mappings"),
    **dict.fromkeys(("best_model_checkpoint", "trial_name"), (_optional(_instance(str)), "a string or null")),
    **dict.fromkeys(("stateful_callbacks", "trial_params"), (_optional(_instance(dict)), "a mapping or null")),
    **dict.fromkeys(
        ("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search"), (_instance(bool), "true or false")
    ),
}


def _check_state(file: Path, state: dict[str, Any]) -> None:
    """Every field of ``trainer_state.json`` one that transformers knows, of the type and range it must have."""
    for key, value in state.items():
        if key not in STATE_FIELDS:
            raise DamagedCheckpoint(f"{file}: unknown field {key}")
        check, expected = STATE_FIELDS[key]
        if not check(value):
            raise DamagedCheckpoint(f"{file}: {key}: expected {expected}, got {value!r}")


def _check_adapter(file: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """The adapter's tensors read whole, are finite, and are the model's adapter tensors, shape for shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise DamagedCheckpoint(f"{file}: not readable safetensors ({one_line(e)})") from None
    for name in sorted(expected.keys() | tensors.keys()):
        if name not in tensors or name not in expected:
            where = "the checkpoint lacks" if name not in tensors else "this model has no"
            raise IncompatibleCheckpoint(f"{file}: {where} adapter tensor {name}")
        if tuple(tensors[name].shape) != tuple(expected[name]):
            raise IncompatibleCheckpoint(
                f"{file}: adapter tensor {name} has shape {list(tensors[name].shape)}, this model's "
                f"{list(expected[name])}"
            )
    _check_finite(file, tensors)


def _torch_load(file: Path) -> Any:
    """``torch.load`` as transformers restores these files (tensors and plain data only), errors as DamagedCheckpoint."""
    import pickle
    import zipfile

    import torch
    from transformers.trainer import safe_globals

    try:
        with safe_globals():
            return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise DamagedCheckpoint(f"{file}: not readable ({one_line(e)})") from None


def _check_finite(file: Path, value: Any) -> None:
    """Every floating-point number inside ``value`` (tensors and floats in nested dicts, lists, tuples) is finite;
    the first that is not is named by its path (a tensor's name, ``state.3.exp_avg_sq`` in an optimizer state)."""
    import torch

    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{where}.{k}".lstrip("."), v) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{where}.{i}".lstrip("."), v) for i, v in enumerate(item))
        elif isinstance(item, torch.Tensor) and item.is_floating_point():
            bad = int((~torch.isfinite(item)).sum())
            if bad:
                raise DamagedCheckpoint(f"{file}: tensor {where} has {bad} NaN or Inf values")
        elif isinstance(item, float) and not math.isfinite(item):
            raise DamagedCheckpoint(f"{file}: {where} is {item}")


__all__ = ["DamagedCheckpoint", "IncompatibleCheckpoint", "REQUIRED_FILES", "check_checkpoint", "sound_checkpoint"]
