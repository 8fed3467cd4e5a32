"""Where a quantized checkpoint may be written, and the clean-up a killed run leaves to the next one.

``--overwrite`` deletes a directory, so it is held to what this tool itself wrote: an existing NVFP4
checkpoint (its config.json carries the compressed-tensors quantization_config) that is neither the
source model nor the working directory, nor contains them. A run killed with SIGKILL cannot remove
its hidden ``.NAME.tmp-*`` (output being written) and ``.NAME.src-*`` (GGUF conversion) siblings;
a later run for the same target removes them, under the target's run lock (``qerl.runlock``) so that
it never deletes the folders of a run that is still going.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from qerl import checkpoint
from qerl.fsutil import is_within

#: Prefixes (after ``.NAME.``) of the hidden siblings a quantize run creates next to its target:
#: ``qerl.fsutil.atomic_directory``'s output folder and the GGUF conversion scratch.
SCRATCH_KINDS = ("tmp-", "src-")


def check_target(out_dir: Path, sources: Sequence[Path], overwrite: bool) -> None:
    """Raise a one-line error unless writing ``out_dir`` can destroy nothing but an earlier output.

    ``sources`` are the paths the source model comes from (its directory, a GGUF file); an
    existing ``out_dir`` may be replaced only with ``overwrite`` and only when it is an NVFP4
    checkpoint that neither is nor contains any of them or the current directory.
    """
    if out_dir.is_symlink():
        raise ValueError(f"--output {out_dir} is a symbolic link; give the directory itself")
    if not out_dir.exists():
        return
    if not overwrite:
        raise FileExistsError(f"output directory {out_dir} already exists; pass --overwrite to replace it")
    target = out_dir.resolve()
    for what, path in [("the source model", p) for p in sources] + [("the current directory", Path.cwd())]:
        if is_within(path, target):
            raise ValueError(f"--output {out_dir} is or contains {what} ({path}); --overwrite would delete it")
    if not out_dir.is_dir() or not (out_dir / "config.json").is_file():
        raise ValueError(
            f"--output {out_dir} is not a checkpoint written by this tool (no config.json); "
            "--overwrite replaces only an earlier NVFP4 output"
        )
    try:
        config = checkpoint.read_config(out_dir)
    except ValueError:
        config = {}
    if not checkpoint.is_nvfp4_config(config):
        raise ValueError(
            f"--output {out_dir} is not an NVFP4 checkpoint (its config.json has no compressed-tensors "
            "nvfp4 quantization_config); --overwrite replaces only an earlier output of this tool"
        )


def scratch_prefix(out_dir: Path, kind: str) -> str:
    """The name prefix of a hidden sibling of ``out_dir`` (``kind`` is one of :data:`SCRATCH_KINDS`)."""
    return f".{out_dir.name}.{kind}"


def remove_stale_scratch(out_dir: Path) -> list[Path]:
    """Delete the hidden siblings an earlier, killed run for ``out_dir`` left; return what was removed.

    Only call this while holding :func:`qerl.runlock.run_lock` on ``out_dir``: a live run for the same
    target holds it too.
    """
    removed = []
    for kind in SCRATCH_KINDS:
        for path in glob.glob(
            os.path.join(glob.escape(str(out_dir.parent)), glob.escape(scratch_prefix(out_dir, kind)) + "*")
        ):
            p = Path(path)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
                removed.append(p)
    return removed
