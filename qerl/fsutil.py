"""Atomic outputs: a directory appears complete or not at all, whatever crashes on the way."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``target`` to write into; rename it onto ``target`` on success.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and ``target``
    is left as it was. With ``replace=False`` an existing ``target`` wins (another process finished
    the same work first) and ours is dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if target.exists():
            if not replace:
                shutil.rmtree(tmp)
                return
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` to write; rename it onto ``target`` on success,
    delete it on failure, so readers only ever see the old file or the complete new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{target.suffix}")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: Path, text: str) -> Path:
    with atomic_file(target) as tmp:
        tmp.write_text(text)
    return target
