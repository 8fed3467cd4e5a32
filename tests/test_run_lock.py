"""One writer per output (README, "What is safe to interrupt"): quantize, train, eval and export hold a lock beside
their output. A second run into it stops in one line naming the holder, a dead holder's lock is taken over, and the
lock is keyed by the resolved directory and never opened through a link. Each test was seen to fail before its fix."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from helpers import EVAL_FLAGS, GOOD, data_file, one_error

from eval import gsm8k
from eval.results import meta_path
from qerl import export
from qerl.cli import run
from qerl.runlock import lock_path, run_lock

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def test_second_writer_is_refused_naming_the_holder(chat_models, tmp_path: Path, capsys) -> None:
    """Item 1: an evaluation (and an export) into an output another live run holds stops in one line
    naming that run's PID, and touches nothing."""
    data = data_file(tmp_path, [GOOD])
    out = tmp_path / "r.jsonl"
    with run_lock(out):
        code = run(
            gsm8k.main, ["--model", str(chat_models["qtiny"]), "--data", str(data), "--output", str(out), *EVAL_FLAGS]
        )
        assert f"another run (PID {os.getpid()}) is writing it" in one_error(code, capsys.readouterr().err)
        code = export.main(
            ["--model", str(chat_models["qtiny"]), "--lora", str(chat_models["adapter"]), "--output", str(out)]
        )
        assert "another run (PID" in one_error(code, capsys.readouterr().err)
    assert not out.exists() and not meta_path(out).exists() and not lock_path(out).exists()


def test_dead_holders_lock_is_taken_over(tmp_path: Path, caplog) -> None:
    """Item 1: a lock file left by a process that died (the kernel dropped its flock) does not block."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "out"
    lock_path(out).write_text(f"{dead.pid}\n")
    with caplog.at_level(logging.WARNING, logger="qerl.runlock"), run_lock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert f"taking over the lock of PID {dead.pid}" in caplog.text and not lock_path(out).exists()


def test_lock_refuses_a_planted_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    from qerl.cli import UsageError
    from qerl.runlock import lock_path, run_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    lock_path(out).symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"), run_lock(out):
        pass
    assert victim.read_text() == "precious\n" and lock_path(out).is_symlink()


def test_lock_is_keyed_by_the_resolved_directory(tmp_path: Path) -> None:
    """``alias`` and ``runs/real`` are one directory: a run into each at once would interleave their files."""
    from qerl.runlock import OutputBusy, run_lock

    real = tmp_path / "runs" / "real"
    real.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "runs-alias").symlink_to(tmp_path / "runs")
    with run_lock(real):
        for other in (tmp_path / "alias", tmp_path / "runs-alias" / "real", real / ".." / "real"):
            with pytest.raises(OutputBusy), run_lock(other):
                pass
