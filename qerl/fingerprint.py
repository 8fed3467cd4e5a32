"""Content digests of model, checkpoint and adapter directories, so that resuming keys on what the
weights *are*, not on the path they were found at (a run retrained into the same directory, or a
model re-quantized in place, must not be taken for the old one).

Hashing a 32B checkpoint reads ~20 GB, so each file's digest is remembered in
``$QERL_CACHE/file-digests.json`` under its resolved path together with its size, inode and
modification/change times (ns); any write, rename onto it or ``touch`` changes one of those and the
file is read again (the blind spot, a same-size rewrite in place within one tick of the kernel's
file clock, a few ms, does not happen between a training run and its evaluation). Entries of files
that no longer exist are dropped; losing the cache (or a concurrent writer's entry) only costs a re-read.

An adapter is bound to its base the same way: training writes ``qerl_base.json`` (the base's digest)
into the adapter it saves (its checkpoints have the run's ``run_config.json`` beside them, which holds
the same digest), and export and evaluation refuse another base in one line
(:func:`check_adapter_base`), whatever the two directories are called.

Shared by three stages (train writes the record and keys its resume on the digests, eval keys its resume on them,
export and eval check the record), so it sits at the top of ``qerl/``, below all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from qerl.cli import UsageError
from qerl.fsutil import atomic_write_text, read_json

_CACHE_NAME = "file-digests.json"
#: Written into every adapter training saves: the digest of the model it was trained on.
BASE_RECORD = "qerl_base.json"
_BLOCK = 1 << 20


def _cache_path() -> Path:
    from qerl.hub import cache_dir

    return cache_dir() / _CACHE_NAME


def _load_cache() -> dict[str, list]:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _file_sha256(path: Path, cache: dict[str, list]) -> str:
    key = str(path.resolve())
    stamp = _stamp(path.stat())
    known = cache.get(key)
    if isinstance(known, list) and known[:-1] == stamp:
        return known[-1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    cache[key] = [*stamp, h.hexdigest()]
    return h.hexdigest()


#: What shapes a model's outputs: its weights, their index and the config that builds the modules around them.
#: Anything else in its directory (notes, a README, a lock file of an output written there) is not the model.
MODEL_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")


def tree_sha256(path: str | os.PathLike[str], patterns: tuple[str, ...] = ("*",)) -> str | None:
    """sha256 over every regular file below ``path`` whose name matches one of ``patterns`` (relative name and
    content; symlinks followed, as in hub snapshots), or of the file itself; None when ``path`` does not exist."""
    root = Path(path).expanduser()
    if not root.exists():
        return None
    cache = _load_cache()
    before = dict(cache)
    files = (
        [root]
        if root.is_file()
        else sorted(p for p in root.rglob("*") if p.is_file() and any(p.match(pattern) for pattern in patterns))
    )
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{_file_sha256(f, cache)}\n".encode())
    if cache != before:
        try:
            live = {k: v for k, v in cache.items() if os.path.exists(k)}
            atomic_write_text(_cache_path(), json.dumps(live))
        except OSError:  # a read-only cache only costs speed
            pass
    return h.hexdigest()


def model_sha256(name_or_path: str | os.PathLike[str]) -> str | None:
    """Digest of the model behind a ``--model`` argument: the :data:`MODEL_FILES` of its local directory (the
    embedded default included), or the file itself; None for a hub id, or for a path that is no model (missing, or a directory
    without config.json, which is not read: loading it will fail with the reason)."""
    from qerl.hub import resolve_model

    try:
        resolved = resolve_model(name_or_path)
    except FileNotFoundError:
        return None
    return resolved_sha256(resolved)


def resolved_sha256(resolved: Path | str) -> str | None:
    """:func:`model_sha256` of a model already resolved (``qerl.hub.resolve_model``: a local path, or a hub id, whose
    digest is None), for a command that resolves its model once."""
    if isinstance(resolved, str) or (resolved.is_dir() and not (resolved / "config.json").is_file()):
        return None
    return tree_sha256(resolved, MODEL_FILES)


def adapter_sha256(path: str | os.PathLike[str]) -> str | None:
    """Digest of a peft adapter directory; None unless it holds adapter_config.json (then it is no adapter,
    and nothing below it, which might be a whole home directory, is read)."""
    root = Path(path).expanduser()
    return tree_sha256(root) if (root / "adapter_config.json").is_file() else None


def write_base_record(adapter_dir: str | os.PathLike[str], model: str, digest: str | None) -> None:
    """Record in ``adapter_dir`` which model (``--model`` as given, and its content digest) it was trained on."""
    atomic_write_text(
        Path(adapter_dir) / BASE_RECORD, json.dumps({"model": model, "model_sha256": digest}, indent=1) + "\n"
    )


def _recorded_base(adapter_dir: Path) -> tuple[str | None, str | None]:
    """(model as given, digest) an adapter was trained on: its own ``qerl_base.json``, else, for a
    ``checkpoint-N`` or ``adapter`` folder inside a run directory, the run's ``run_config.json``."""
    for path, name_key in (
        (adapter_dir / BASE_RECORD, "model"),
        (adapter_dir.parent / "run_config.json", "model_name"),
    ):
        try:
            record = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("model_sha256"), str):
            return record.get(name_key), record["model_sha256"]
    return None, None


def check_adapter_base(adapter_dir: str | os.PathLike[str], model: str, allow_mismatch: bool = False) -> bool | None:
    """Whether the adapter in ``adapter_dir`` was trained on ``model``, by content: True when its recorded
    base digest (:func:`_recorded_base`) is ``model``'s, None when that cannot be known (no record, e.g. an
    adapter made elsewhere; a hub id), after the name peft recorded was checked (:func:`_check_recorded_name`).
    A different digest raises a one-line UsageError unless ``allow_mismatch``. Export and evaluation both ask
    here, so an adapter one of them refuses the other refuses too."""
    name, recorded = _recorded_base(Path(adapter_dir).expanduser())
    digest = model_sha256(model) if recorded is not None else None
    if digest is None:
        _check_recorded_name(Path(adapter_dir).expanduser(), model, allow_mismatch)
        return None
    if digest == recorded:
        return True
    if allow_mismatch:
        return False
    raise UsageError(
        f"--lora {adapter_dir}: was trained on {name!r} (sha256 {recorded[:12]}), but "
        f"--model {model} has other weights (sha256 {digest[:12]}); pass --allow-base-mismatch to use it anyway"
    )


def _names(name_or_path: str | None) -> set[str]:
    """Spellings under which a model may be recorded: the path as given and resolved, its last component,
    and the repo id behind a hub-cache snapshot path (``models--org--name/snapshots/<hash>``).

    Matching by last component lets an adapter trained on ``/gpu-box/qmodel/X`` be evaluated on
    ``./qmodel/X``; it is only a guard against obvious mix-ups, the shape check is the hard one."""
    if not name_or_path:
        return set()
    text = str(name_or_path).rstrip("/")
    names = {text, Path(text).name}
    path = Path(text).expanduser()
    if path.exists():
        names.add(str(path.resolve()))
    hub = re.search(r"models--([^/]+?)--([^/]+)", text)
    if hub:
        names |= {f"{hub.group(1)}/{hub.group(2)}", hub.group(2)}
    return names


def _check_recorded_name(adapter_dir: Path, model: str, allow_mismatch: bool) -> None:
    """For an adapter without a digest record: refuse (unless ``allow_mismatch``) when the base peft recorded in
    its adapter_config.json (``base_model_name_or_path``) shares no spelling (:func:`_names`) with ``model``."""
    from qerl.hub import resolve_model

    try:
        recorded = read_json(adapter_dir / "adapter_config.json").get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return
    if not recorded or allow_mismatch:
        return
    try:
        resolved = resolve_model(model)
    except (FileNotFoundError, ValueError):
        resolved = None
    if _names(recorded) & (_names(model) | _names(None if resolved is None else str(resolved))):
        return
    raise UsageError(
        f"--lora {adapter_dir}: adapter was made for base model {recorded!r}, but --model is {model!r}; "
        "pass --allow-base-mismatch if they are the same weights"
    )


__all__ = [
    "BASE_RECORD",
    "MODEL_FILES",
    "adapter_sha256",
    "check_adapter_base",
    "model_sha256",
    "resolved_sha256",
    "tree_sha256",
    "write_base_record",
]
