"""Where a quantized checkpoint may be written.

``--overwrite`` deletes a directory, so it is held to what this tool itself wrote: an existing NVFP4
checkpoint (its config.json carries the compressed-tensors quantization_config) that is neither the
source model nor the working directory, nor contains them. What a killed run left beside the target
(its marked ``.NAME.tmp-*`` output and ``.NAME.src-*`` GGUF conversion) the next run removes under the
target's run lock (``qerl.fsutil.remove_leftovers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qerl import checkpoint
from qerl.fsutil import is_within, refuse_link


def check_target(out_dir: Path, sources: Sequence[Path], overwrite: bool) -> None:
    """Raise a one-line error unless writing ``out_dir`` can destroy nothing but an earlier output.

    ``sources`` are the paths the source model comes from (its directory, a GGUF file); an
    existing ``out_dir`` may be replaced only with ``overwrite`` and only when it is an NVFP4
    checkpoint that neither is nor contains any of them or the current directory. An output inside the source
    model's directory is refused, as export refuses one inside its model: the source would change under its
    digest and hold a second model.
    """
    refuse_link(out_dir, "--output")
    for source in sources:
        if source.is_dir() and out_dir.resolve() != source.resolve() and is_within(out_dir, source):
            raise ValueError(
                f"--output {out_dir} is inside the source model directory ({source}); choose one outside it"
            )
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
