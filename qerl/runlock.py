"""One writer per output: the lock every command that writes an output (quantize, train, eval, export) holds.

Two runs into one output interleave their files (two trainings' ``metrics.jsonl`` rows, two
evaluations' samples, one run renaming a file the other just renamed), so a second writer is refused
at once, in one line naming the holder's PID. The lock is ``flock`` on a hidden sibling
``.NAME.lock`` of the output (beside it, not inside, so that a file output and a directory that does
not exist yet are locked the same way) holding the holder's PID. The kernel drops the lock of a
process that dies, even by SIGKILL, so a dead holder's lock file is simply taken over by the next
run (which says so); the file is removed when the run ends.

The lock is keyed by what the output *is*, not how it is spelled: its path with every link and ``..``
resolved, so ``alias`` (a link to ``runs/a``) and ``runs/a`` share one lock. The lock file is opened
without following a link: one planted at ``.NAME.lock`` would otherwise have its target's content
replaced by our PID (and the target deleted at the end), so a link there, or anything but a regular
file of one name (a hard link would have the file it shares overwritten), is refused in one line.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl.cli import UsageError

logger = logging.getLogger(__name__)


class OutputBusy(UsageError):
    """Another live process holds the output's lock."""


def lock_path(output: str | os.PathLike[str]) -> Path:
    """The hidden lock file beside ``output`` resolved (links and ``..`` followed), so that every spelling of
    one output names one lock."""
    resolved = Path(output).expanduser().resolve()
    return resolved.parent / f".{resolved.name}.lock"


def _open_lock_file(path: Path, flag: str, output: Path) -> int:
    """``path`` opened for reading and writing (created when missing), never through a link, and only when it is a
    regular file of one name: the PID written into a hard-linked one would replace the content of the file it
    shares (and a directory there was a traceback)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise UsageError(f"{flag} {output}: its lock {path} is a directory, not a lock file; remove it") from None
        if e.errno != errno.ELOOP:
            raise
        raise UsageError(
            f"{flag} {output}: its lock {path} is a symbolic link, which qerl never writes; "
            "remove it (the file it points to is left untouched)"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a hard link ({info.st_nlink} names)"
        raise UsageError(f"{flag} {output}: its lock {path} is {what}, which qerl never writes; remove it")
    return fd


def _read_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 32).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


@contextmanager
def run_lock(output: str | os.PathLike[str], flag: str = "--output") -> Iterator[None]:
    """Hold ``output``'s lock for the block; raise :class:`OutputBusy` naming the holder when a live
    process has it. ``flag`` names the output in the message (``--output-dir`` for a training run).

    A run that locked a file another run had just removed sees the inode change and locks the new
    file (the usual lock-file-with-unlink rule), so the removal at the end never lets two runs in.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(output)
    while True:
        fd = _open_lock_file(path, flag, output)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise OutputBusy(
                f"{flag} {output}: another run (PID {holder if holder else 'unknown'}) is writing it "
                f"(lock {path}); wait for it to finish or choose another {flag}"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        previous = _read_pid(fd)
        if previous is not None and previous != os.getpid():
            logger.warning("%s: taking over the lock of PID %d, which is no longer running", output, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


__all__ = ["OutputBusy", "lock_path", "run_lock"]
