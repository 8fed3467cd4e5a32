"""A model directory is data: what qerl checks in one before any library (or qerl itself) reads it. Quantize, load,
train, eval and export all come through :func:`checked_config` (the tokenizer alone through :func:`check_files`).

* **No code unasked.** ``auto_map`` in config.json or tokenizer_config.json names Python files of the directory
  that transformers imports, after asking "[y/N]" on stdin, which ``echo y |`` answered: the directory's code ran in
  eval and train. A model with ``auto_map`` is refused in one line unless the command's ``--trust-remote-code``
  (eval, train) says so, and every transformers call gets ``trust_remote_code`` explicitly. Quantize and export
  refuse it always: they never run a model's code, so they do not copy it (nor its ``auto_map``) into an output.
* **Bounded, regular files.** The small files libraries read whole (``*.json``, the tokenizer's, chat templates:
  :data:`SMALL_FILES`) must be regular files within ``qerl.fsutil.SMALL_FILE_BYTES``, and the weights regular files
  (``config.json -> /dev/zero`` was read whole until killed at 6 GiB, a FIFO as weights hung the load).
* **No links out of it into an output.** A side file copied into an output (``qerl.hub.SIDE_FILES``) that is a link
  to a file outside the model directory is refused: a link to a secret was copied as a regular file holding it. A
  Hugging Face cache snapshot (``models--ORG--NAME/snapshots/REV``) is all links into its repository's ``blobs``;
  those stay within the model.
* **Fields.** config.json's sizes, heads, RoPE type and shapes: ``qerl.config_fields``.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

from qerl import arch, checkpoint, config_fields, hub
from qerl.fsutil import check_regular, check_small, is_within, read_json

#: The files that may name the directory's code.
CODE_CONFIGS = ("config.json", "tokenizer_config.json")
#: Files libraries read whole from a model directory.
SMALL_FILES = ("*.json", "*.txt", "*.jinja", *hub.SIDE_FILES)
#: The flag that lets eval and train run a model's own code.
TRUST_FLAG = "--trust-remote-code"


def check_files(model_dir: Path, *, trust_remote_code: bool = False, copying: bool = False) -> None:
    """Raise a one-line ``ValueError`` naming the file unless ``model_dir`` holds what the module docstring says:
    bounded regular small files, regular weights, no ``auto_map`` unless ``trust_remote_code``, and, when the caller
    copies side files into an output (``copying``: quantize, export), none linked out of the model."""
    for path in sorted(model_dir.iterdir()):
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in SMALL_FILES):
            check_small(path)
        elif path.suffix == ".safetensors":
            check_regular(path)
    if copying:
        side_files(model_dir)
    for name in CODE_CONFIGS:
        path = model_dir / name
        record = read_json(path) if path.exists() else None
        if not isinstance(record, dict) or "auto_map" not in record:
            continue
        auto_map = record["auto_map"]
        code = (", ".join(map(str, auto_map.values())) if isinstance(auto_map, dict) else str(auto_map))[:200]
        if copying:
            raise ValueError(
                f"{path}: auto_map names code in the model directory ({code}); quantize and export never run a "
                "model's own code, nor copy it into their output: remove auto_map to use transformers' own classes"
            )
        if not trust_remote_code:
            raise ValueError(
                f"{path}: auto_map names code in the model directory ({code}); qerl runs a model's own code "
                f"only with {TRUST_FLAG}"
            )


def _own_tree(model_dir: Path) -> Path:
    """The folder a model's links may point into: the model directory, or for a Hugging Face cache snapshot
    (``models--ORG--NAME/snapshots/REV``) its repository folder, whose ``blobs`` the snapshot's files link to."""
    resolved = model_dir.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def side_files(model_dir: Path) -> list[Path]:
    """The side files (``qerl.hub.SIDE_FILES``: tokenizer, generation config, chat template) that quantize and export
    copy next to their weights: regular files within bounds, none a link out of the model (one-line ``ValueError``)."""
    root = _own_tree(model_dir)
    found = []
    for path in sorted(model_dir.iterdir()):
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in hub.SIDE_FILES):
            continue
        if path.is_symlink() and not is_within(path, root):
            raise ValueError(
                f"{path}: a symbolic link to {path.resolve()}, outside the model directory; copy the file in "
                "(quantize and export copy side files into their output)"
            )
        check_small(path)
        found.append(path)
    return found


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy ``src``'s side files (:func:`side_files`: tokenizer, generation config, chat template; never other weights,
    never a link out of the model) into ``dst``, beside the weights quantize or export wrote there."""
    for f in side_files(src):
        shutil.copy2(f, dst / f.name)


def checked_config(
    model_dir: Path, *, trust_remote_code: bool = False, copying: bool = False
) -> tuple[dict, arch.Family]:
    """``model_dir``'s config.json and family once the directory passed :func:`check_files` and the config describes
    a supported model whose fields (``qerl.config_fields``), layer count and tensor shapes are the weights':
    everything from headers, before any skeleton or tensor is allocated."""
    check_files(model_dir, trust_remote_code=trust_remote_code, copying=copying)
    where = str(model_dir / "config.json")
    config = checkpoint.read_config(model_dir)
    family = arch.check_config(config, where)
    config_fields.check_fields(config, where)
    tensors = checkpoint.TensorIndex(model_dir)
    checkpoint.check_layer_count(model_dir, config, tensors)
    config_fields.check_shapes(config, tensors, where)
    return config, family
