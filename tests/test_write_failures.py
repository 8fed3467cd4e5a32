"""A write that fails or is cut short leaves nothing partial under a final name and says which file (README, "What is
safe to interrupt"): two writers of one file never share a temp file, an append cut short by a full disk is rolled
back to the last whole line, a full or read-only disk is ``error: cannot write FILE: reason``, an evaluation stopped
at its first write leaves no empty output, and a rerun removes what a killed export left. Each test was seen to fail
before its fix; ``tests/test_faults.py`` fails every write of every command in turn."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EVAL_FLAGS, GOOD, data_file, one_error, run_export

from qerl import export
from qerl.fsutil import atomic_file

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def test_two_atomic_writers_of_one_file_do_not_collide(tmp_path: Path) -> None:
    """Item 1: two writers of the same file (two runs drawing one plot) each get their own temp file;
    the shared temp name made the second rename fail with FileNotFoundError."""
    target = tmp_path / "plot.csv"
    with atomic_file(target) as first, atomic_file(target) as second:
        assert first != second
        first.write_text("a\n")
        second.write_text("b\n")
    assert target.read_text() == "a\n" and [p.name for p in tmp_path.iterdir()] == ["plot.csv"]


def test_full_disk_mid_append_leaves_no_part_of_a_line(tmp_path: Path, monkeypatch) -> None:
    """Item 4: results and metrics are appended; a write cut short by a full disk is rolled back to the
    last whole line instead of leaving half a record for the next reader."""
    from qerl.fsutil import append_whole

    path = tmp_path / "m.jsonl"
    append_whole(path, '{"step": 1}\n')
    real_write, calls = os.write, []

    def short_then_full(fd: int, data) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:4]))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError, match="No space left"):
        append_whole(path, '{"step": 2}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n' and len(calls) == 2


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_is_one_line(chat_models, tmp_path: Path, capsys, monkeypatch, code: int) -> None:
    """Item 4: safetensors' ``SafetensorError: ... No space left on device`` (and EROFS) was a traceback
    with rc 1; now ``error: cannot write FILE: reason``, rc 2, and no output under its final name."""
    from safetensors import SafetensorError

    def failing(tensors, filename, metadata=None):
        raise SafetensorError(
            f'Error while serializing: IoError(Os {{ code: {code}, kind: Other, message: "{os.strerror(code)}" }})'
        )

    monkeypatch.setattr("safetensors.torch.save_file", failing)
    rc = export.main(
        ["--model", str(chat_models["qtiny"]), "--lora", str(chat_models["adapter"]), "--output", str(tmp_path / "x")]
    )
    line = one_error(rc, capsys.readouterr().err)
    assert line.startswith(f"error: cannot write {tmp_path}") and line.endswith(os.strerror(code).lower()), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def _full_disk(*args: object, **kwargs: object) -> None:
    """A full disk as ``write()`` or ``fsync()`` report it: an errno and no file name."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_export_full_disk_names_the_file(merge, tmp_path: Path, capsys, monkeypatch) -> None:
    """``error: cannot write: no space left on device`` named no file; now the file, under the output's own name."""
    real = Path.write_text
    monkeypatch.setattr(
        Path, "write_text", lambda self, *a, **k: _full_disk() if self.name == "config.json" else real(self, *a, **k)
    )
    code, err = run_export(merge, tmp_path / "out", capsys)
    assert one_error(code, err) == f"error: cannot write {tmp_path / 'out' / 'config.json'}: no space left on device"
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []


def test_eval_stopped_at_its_first_write_leaves_no_empty_output(qtiny, tmp_path: Path, capsys, monkeypatch) -> None:
    """A full disk at eval's first write left a 0-byte JSONL (and its meta file) and named no file; now nothing
    is left and the message names the results file."""
    from eval import gsm8k
    from qerl.cli import run

    out = tmp_path / "r.jsonl"
    argv = ["--model", str(qtiny), "--data", str(data_file(tmp_path, [GOOD])), "--output", str(out), *EVAL_FLAGS]
    monkeypatch.setattr(os, "fsync", _full_disk)
    error = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["d.jsonl"]
    assert error == f"error: cannot write {out}: no space left on device"


#: An export killed (SIGKILL: nothing of it runs on the way out) after its dense merge, inside the re-quantization.
_KILLED_EXPORT = """
import os, signal, sys
from qerl import export
export.requantize = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
sys.exit(export.main(sys.argv[1:]))
"""


def test_rerun_removes_what_a_killed_nvfp4_export_left(merge, tmp_path: Path, capsys) -> None:
    """A killed --format nvfp4 export left a dense copy of the model (``.NAME.bf16-*``) and its partial output
    (``.NAME.tmp-*``) that no rerun removed; now the rerun removes them, and only them: a look-alike directory
    without our mark, and a link to a marked one, stay."""
    from qerl.fsutil import SCRATCH_MARK

    out = tmp_path / "out"
    argv = ["--model", str(merge["model"]), "--lora", str(merge["adapter"]), "--output", str(out), "--format", "nvfp4"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr
    left = sorted(p.name.rpartition("-")[0] for p in tmp_path.glob(".out.*-*"))
    assert left == [".out.bf16", ".out.tmp"] and not out.exists()
    foreign = tmp_path / ".out.tmp-notours"
    foreign.mkdir()
    (foreign / "keep").write_text("mine")
    marked = tmp_path / "elsewhere"
    marked.mkdir()
    (marked / SCRATCH_MARK).touch()
    (tmp_path / ".out.bf16-link").symlink_to(marked)

    assert export.main(argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(".out.*-*")) == [".out.bf16-link", ".out.tmp-notours"]
    assert (foreign / "keep").read_text() == "mine" and (marked / SCRATCH_MARK).exists()
    assert not (out / SCRATCH_MARK).exists()
