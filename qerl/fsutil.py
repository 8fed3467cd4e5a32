"""Atomic outputs: a directory or file appears complete or not at all, whatever crashes on the way
(a kill, a full disk, a read-only file system), and an appended line is whole or absent. A failed
``write()`` or ``fsync()`` reports only its errno; every writer here names the file it was writing
(:func:`naming`), so a full disk reads ``cannot write FILE``, not ``cannot write``."""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Written into every scratch directory made here (and taken out of one renamed into place), so that a later
#: run can tell a directory a killed run of ours left from one someone else named alike.
SCRATCH_MARK = ".qerl-scratch"


@contextmanager
def naming(path: Path, temporary: Path | None = None) -> Iterator[None]:
    """Give an ``OSError`` raised inside the file name it lacks: ``path``, or for a file under ``temporary``
    (the scratch copy of ``path`` being written) the same file under ``path``, which is what the user asked for."""
    try:
        yield
    except OSError as e:
        if e.errno is None:  # raised with a message of its own (FileNotFoundError("no such model")), not by a call
            raise
        name = None if e.filename is None else Path(os.fsdecode(e.filename))
        if name is None:
            e.filename = str(path)
        elif temporary is not None and name.is_relative_to(temporary):
            e.filename = str(path / name.relative_to(temporary)) if name != temporary else str(path)
        raise


def current_umask() -> int:
    """The process's umask, from ``/proc/self/status`` where Linux gives it: the portable way, setting it and
    setting it back, would for a moment change it under every other thread of the process."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(path: Path) -> None:
    """Give ``path``, and everything under it when it is a directory, the permissions ``open()`` and ``mkdir()``
    give under the user's umask: files 0o666 and directories 0o777, less the umask. Links are left alone.

    Why: a temporary name from ``tempfile`` (a 0600 file, a 0700 directory) and every file safetensors writes
    (0600, from safetensors 0.8) would otherwise reach its final name readable by its owner alone, so that a
    server or a colleague running as another user could not read a model, an adapter or a result. Every writer
    of qerl ends here: the atomic writes below, and the trainer's checkpoints, which transformers writes in place.
    """
    mask = current_umask()
    if path.is_symlink():
        return
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    for parent, dirs, files in os.walk(path):  # links to directories are not followed
        for name in dirs + files:
            entry = os.path.join(parent, name)
            if not os.path.islink(entry):
                os.chmod(entry, (0o777 if name in dirs else 0o666) & ~mask)


@contextmanager
def atomic_directory(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``target`` to write into; rename it onto ``target`` on success.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and ``target``
    is left as it was. With ``replace=False`` an existing ``target`` wins (another process finished
    the same work first) and ours is dropped.
    """
    tmp = _scratch(target, "tmp")
    try:
        with naming(target, tmp):
            yield tmp
        (tmp / SCRATCH_MARK).unlink()
        umask_modes(tmp)
        if target.exists():
            if not replace:
                shutil.rmtree(tmp)
                return
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _scratch(target: Path, kind: str) -> Path:
    """A new marked directory ``.NAME.KIND-XXXX`` beside ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{kind}-"))
    (tmp / SCRATCH_MARK).touch()
    return tmp


@contextmanager
def scratch_directory(target: Path, kind: str) -> Iterator[Path]:
    """A marked temporary directory beside ``target`` for intermediate work (``kind`` names it), removed
    on the way out whatever happens; one a kill left behind is found by :func:`remove_leftovers`."""
    tmp = _scratch(target, kind)
    try:
        with naming(target, tmp):
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the scratch directories of :func:`atomic_directory` and :func:`scratch_directory` for ``target``
    that a killed run left beside it (a killed ``--format nvfp4`` export leaves a whole dense copy of the model),
    and return them. Only a real directory named ``.NAME.KIND-XXXX`` holding :data:`SCRATCH_MARK` is ours: a
    link or an unmarked directory is left alone. Call it only while holding ``target``'s run lock
    (``qerl.runlock``), so that no live writer's scratch is taken for a leftover."""
    removed = []
    for entry in sorted(target.parent.glob(f".{glob.escape(target.name)}.*-*")):
        mark = entry / SCRATCH_MARK
        if entry.is_dir() and not entry.is_symlink() and mark.is_file() and not mark.is_symlink():
            shutil.rmtree(entry)
            logger.info("removed %s, left by an interrupted run", entry)
            removed.append(entry)
    return removed


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` to write; rename it onto ``target`` on success,
    delete it on failure, so readers only ever see the old file or the complete new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer: two processes writing the same target must not rename each other's file.
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.tmp-", suffix=target.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        with naming(target, tmp):
            yield tmp
        umask_modes(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: Path, text: str, *, durable: bool = False) -> Path:
    """Write ``text`` to ``target`` through :func:`atomic_file`; ``durable`` pushes it to disk before the
    rename, so that a full disk found only by ``fsync`` leaves no file rather than an empty one."""
    with atomic_file(target) as tmp, tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return target


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)`` whose failure names ``path`` (a full disk found by ``write()`` names no file)."""
    with naming(path):
        path.write_text(text)


def real_output(path: Path, flag: str) -> Path:
    """``path`` resolved, once it is known not to be a symbolic link itself and to resolve at all; ValueError in one
    line naming ``flag`` otherwise. A link planted at an output in a shared folder (``/tmp/run`` pointing elsewhere)
    would have a command write, replace or delete where the link's owner chose; a loop of links made every ``resolve``
    a traceback."""
    refuse_link(path, flag)
    try:
        return path.expanduser().resolve()
    except RuntimeError:  # a loop, up to Python 3.12 (from 3.13: OSError ELOOP)
        raise ValueError(f"{flag} {path}: cannot be resolved (a loop of symbolic links)") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be resolved ({e.strerror})") from None


#: The most bytes a small file (a model's config and tokenizer files, an index, adapter_config.json) may hold: every
#: one is read whole, so ``config.json -> /dev/zero`` or a planted 10 GB one must stop here. The largest real ones
#: are tokenizers (Gemma 3's tokenizer.json: 33 MB).
SMALL_FILE_BYTES = 64 << 20

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _refuse_special(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: is {_KINDS.get(stat.S_IFMT(mode), 'a special file')}, not a regular file")


def check_small(path: Path, limit: int | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``path`` (links followed) is a regular file of at most ``limit`` bytes
    (default :data:`SMALL_FILE_BYTES`): for a file a library reads whole after us (a FIFO hangs its reader, a
    device never ends). Ours are read by :func:`read_small`."""
    limit = SMALL_FILE_BYTES if limit is None else limit
    st = os.stat(path)
    _refuse_special(path, st.st_mode)
    if st.st_size > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")


def check_regular(path: Path) -> None:
    """Raise a one-line ``ValueError`` unless ``path`` (links followed) is a regular file, of any size (weights)."""
    _refuse_special(path, os.stat(path).st_mode)


def read_small(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the small file ``path``; a one-line ``ValueError`` when it is not a regular file or holds more
    than ``limit`` bytes (default :data:`SMALL_FILE_BYTES`), of which no more than that are read. Opened without
    blocking, so that a FIFO is refused by its descriptor instead of waited on."""
    limit = SMALL_FILE_BYTES if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data


def read_json(path: Path, limit: int | None = None) -> Any:
    """:func:`read_small` parsed as JSON; a file that is not JSON (or nests past the parser's depth) is one line."""
    data = read_small(path, limit)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def refuse_link(path: Path, flag: str, what: str = "directory") -> None:
    """Raise a one-line ``ValueError`` when the output ``path`` is a symbolic link: writing through it changes the
    link's target, someone else's file, and replacing it would remove that target, or fail after all the work."""
    if Path(path).is_symlink():
        raise ValueError(f"{flag} {path}: is a symbolic link; name the {what} itself")


def is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or lies inside it, both resolved (links and ``..`` followed)."""
    path, root = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    return path == root or root in path.parents


def append_whole(path: Path, text: str) -> None:
    """Append ``text`` (whole lines) to ``path`` and push it to disk; if any of it fails (a full disk
    half-way), cut the file back to its old length, so that readers never see part of a line."""
    with naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # less the umask, as open() does
        try:
            size = os.fstat(fd).st_size
            try:
                data = memoryview(text.encode("utf-8"))
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with an I/O failure raised as the ``OSError`` it is: safetensors
    reports a full disk as ``SafetensorError: ... Os { code: 28, ... }``, which names no file."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        code = os_errno(e)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


def os_errno(error: BaseException) -> int | None:
    """The errno behind ``error``: its own, or the one a library wrapped into its message (safetensors'
    ``Os { code: N``, or the reason's text, as torch's writer gives it); None when it is not an I/O failure."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    text = str(error)
    found = re.search(r"Os \{ code: (\d+)", text)
    if found:
        return int(found.group(1))
    return next((code for code in (errno.ENOSPC, errno.EROFS, errno.EDQUOT) if os.strerror(code) in text), None)
