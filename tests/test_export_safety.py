"""Where export may write: never inside the model directory, whose digest its output would change (the run's own
adapter then counted as made for "other weights"), nor through a link at --output. Each test was seen to fail
before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import one_error, run_export

from qerl import export
from qerl.fingerprint import model_sha256

pytestmark = pytest.mark.usefixtures("own_caches")


@pytest.mark.parametrize("inside", ["export", "sub/dir/export", "."])
def test_export_into_the_model_directory_is_refused(merge, tmp_path: Path, capsys, inside: str) -> None:
    """--output MODEL/export wrote a checkpoint into the model directory (rc 0), after which the model's digest
    changed and every adapter trained on it, this one included, was refused as made for other weights."""
    model = shutil.copytree(merge["model"], tmp_path / "model")
    digest = model_sha256(model)
    out = model / inside
    argv = ["--model", str(model), "--lora", str(merge["adapter"]), "--output", str(out), "--allow-base-mismatch"]
    line = one_error(export.main(argv), capsys.readouterr().err)
    assert f"--output {out}: is inside the model directory" in line or "is the model directory" in line, line
    assert model_sha256(model) == digest and sorted(p.name for p in model.iterdir()) == sorted(
        p.name for p in merge["model"].iterdir()
    )


# --- a link at --output ------------------------------------------------------------------------------------------------


def test_export_to_a_symlink_is_refused_before_the_merge(merge, tmp_path: Path, capsys, monkeypatch) -> None:
    """--output LINK --overwrite, LINK pointing at an earlier export: a traceback after the whole merge; now one line
    before any work, the earlier export untouched."""
    assert run_export(merge, tmp_path / "real", capsys)[0] == 0
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setattr(export, "merge_to_dense", lambda *a, **k: pytest.fail("merged before checking --output"))
    code, err = run_export(merge, tmp_path / "link", capsys, "--overwrite")
    assert "is a symbolic link" in one_error(code, err)
    assert (tmp_path / "real" / export.MARKER).is_file() and (tmp_path / "link").is_symlink()
