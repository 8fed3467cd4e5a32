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
