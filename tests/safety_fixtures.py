"""What the tests of hostile inputs share (test_model_dir_safety, test_config_validation, test_adapter_safety,
test_eval_safety, test_export_safety): the tiny models of the earlier reliability tests, caches of the test's own,
and a child process for commands that may hang or exhaust memory before their fix (a hang inside a regular
expression or a blocking open cannot be interrupted from inside)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability3 import EVAL_FLAGS, GOOD, _data, _one_error, _with_config, qtiny
from test_reliability5 import merge

ROOT = Path(__file__).resolve().parents[1]
#: The address space a child gets: /dev/zero read whole fails there at once, not at the machine's end.
CHILD_MEMORY = 6 << 30
data_file, one_error, with_config = _data, _one_error, _with_config
__all__ = ["EVAL_FLAGS", "GOOD", "data_file", "eval_argv", "merge", "one_error", "own_caches", "qtiny", "run_module"]


@pytest.fixture(autouse=True)
def own_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our digest cache, and transformers' copy of a model's code (a test that trusts it writes one) in tmp_path."""
    from transformers import dynamic_module_utils

    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))


def eval_argv(model: Path, tmp_path: Path, *flags: str) -> list[str]:
    """``eval.gsm8k``'s arguments for one question on ``model`` into ``tmp_path/r.jsonl``."""
    out = tmp_path / "r.jsonl"
    return ["--model", str(model), "--data", str(_data(tmp_path, [GOOD])), "--output", str(out), *EVAL_FLAGS, *flags]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def run_module(argv: list[str], tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    """``python -m ARGV`` in a child of :data:`CHILD_MEMORY` bytes; the test fails if it still runs after ``timeout``."""
    env = {**os.environ, "QERL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    how = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": timeout, "preexec_fn": _limited}
    try:
        done = subprocess.run([sys.executable, "-m", *argv], **how)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m {argv[0]} still ran after {timeout} s")
    return done.returncode, done.stderr
