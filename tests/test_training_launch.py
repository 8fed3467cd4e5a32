"""The per-size training scripts' ``--num-gpus N``: one GPU runs ``python -m qerl.train``, N GPUs run
``accelerate launch`` with training/accelerate/ddp.yaml, and the per-step batch stays the same (N
processes x batch/N completions of the same num_generations). ``$PYTHON`` is a stub that records its
arguments, so nothing trains here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def launched(tmp_path: Path, script: str, *args: str) -> tuple[int, list[str], str]:
    """(exit code, the arguments ``python`` got, stderr) of ``bash training/SCRIPT ARGS``."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir(exist_ok=True)
    record = tmp_path / "argv"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\n')
    stub.chmod(0o755)
    record.unlink(missing_ok=True)
    env = {**os.environ, "PYTHON": str(stub)}
    proc = subprocess.run(["bash", str(ROOT / "training" / script), *args], env=env, capture_output=True, text=True)
    argv = record.read_text().splitlines() if record.exists() else []
    return proc.returncode, argv, proc.stderr


def flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last occurrence wins, as in argparse


@pytest.mark.parametrize(
    "script,batch", [("dapo_qwen2.5-7b_nvfp4_single_gpu.sh", 2), ("dapo_qwen2.5-32b_nvfp4_single_gpu.sh", 8)]
)
def test_num_gpus_keeps_the_per_step_batch(tmp_path: Path, script: str, batch: int) -> None:
    code, one, _ = launched(tmp_path, script, "--max-steps", "3")
    assert code == 0 and one[:2] == ["-m", "qerl.train"] and "--num-gpus" not in one
    assert int(flag(one, "--per-device-train-batch-size")) == batch == int(flag(one, "--num-generations"))

    code, two, _ = launched(tmp_path, script, "--num-gpus", "2", "--max-steps", "3")
    assert code == 0 and two[:2] == ["-m", "accelerate.commands.launch"] and "--num-gpus" not in two
    config = Path(flag(two, "--config_file"))
    assert config == ROOT / "training" / "accelerate" / "ddp.yaml"
    assert yaml.safe_load(config.read_text())["distributed_type"] == "MULTI_GPU"
    processes = int(flag(two, "--num_processes"))
    train = two[two.index("qerl.train") + 1 :]
    assert two[two.index("qerl.train") - 1] == "-m" and flag(train, "--max-steps") == "3"
    assert processes * int(flag(train, "--per-device-train-batch-size")) == batch
    assert int(flag(train, "--num-generations")) == batch
    assert flag(train, "--output-dir") == flag(one, "--output-dir") + "_g2"  # never resumes the 1-GPU run


def test_num_gpus_must_divide_the_batch(tmp_path: Path) -> None:
    for value in ("3", "0", "two"):
        code, argv, err = launched(tmp_path, "dapo_qwen2.5-7b_nvfp4_single_gpu.sh", "--num-gpus", value)
        assert code == 2 and argv == [] and err.startswith("error: --num-gpus") and err.count("\n") == 1, err
