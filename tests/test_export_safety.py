"""Where export may write (issue 72): never inside the model directory, whose digest its output would change (the
run's own adapter then counted as made for "other weights"). Seen to fail before the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safety_fixtures as sf
import torch
from safety_fixtures import merge, own_caches  # noqa: F401 (fixtures)

from qerl import export
from qerl.load.fingerprint import model_sha256

torch.set_num_threads(1)


@pytest.mark.parametrize("inside", ["export", "sub/dir/export", "."])
def test_export_into_the_model_directory_is_refused(merge, tmp_path: Path, capsys, inside: str) -> None:  # noqa: F811
    """--output MODEL/export wrote a checkpoint into the model directory (rc 0), after which the model's digest
    changed and every adapter trained on it, this one included, was refused as made for other weights."""
    model = shutil.copytree(merge["model"], tmp_path / "model")
    digest = model_sha256(model)
    out = model / inside
    argv = ["--model", str(model), "--lora", str(merge["adapter"]), "--output", str(out), "--allow-base-mismatch"]
    line = sf.one_error(export.main(argv), capsys.readouterr().err)
    assert f"--output {out}: is inside the model directory" in line or "is the model directory" in line, line
    assert model_sha256(model) == digest and sorted(p.name for p in model.iterdir()) == sorted(
        p.name for p in merge["model"].iterdir()
    )
