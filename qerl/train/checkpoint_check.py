"""Whether a training checkpoint can be resumed: every file read back whole and finite, its adapter the model's.

transformers restores a checkpoint's files one by one where it meets them: a truncated ``trainer_state.json``,
``optimizer.pt`` or adapter was a traceback mid-restore, and one NaN in the optimizer's moments turned every
trained weight NaN with exit status 0. :func:`sound_checkpoint` checks all of it before anything is restored, so a
refused resume changes nothing in the run's directory (``qerl.train.run`` records the run's settings only after it).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from qerl.cli import UsageError, one_line
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
    reads back whole and finite and its adapter has the tensors and shapes ``adapter_shapes`` (the model's).

    Why all of it: transformers restores each file where it meets it, so a truncated one was a traceback
    mid-restore, and one NaN in the optimizer's moments turned every trained weight NaN with exit status 0.
    Checking before anything is restored also keeps a refused resume from changing the run's files."""
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise DamagedCheckpoint(f"{path / name}: missing")
    for name in (CHECKPOINT_MARKER, "trainer_state.json"):
        try:
            if not isinstance(json.loads((path / name).read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise DamagedCheckpoint(f"{path / name}: not readable JSON ({one_line(e)})") from None
    _check_adapter(path / "adapter_model.safetensors", adapter_shapes)
    for file in sorted(path.glob("*.pt")) + sorted(path.glob("rng_state*.pth")):
        _check_finite(file, _torch_load(file))


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
